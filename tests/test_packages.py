"""Uploaded code packages (service/packages.py), without a server: what a zip may hold."""
from __future__ import annotations

import io
import zipfile

import pytest

from service import packages


def zipped(**files: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name.replace("__", "/"), data)
    return buf.getvalue()


def test_a_zip_that_expands_past_the_limit_is_refused_saying_the_limit(tmp_path):
    bomb = zipped(**{"model.py": b"x = 1\n", "data.bin": bytes(2 << 20)})  # 2 MiB of zeros: about 2 KiB zipped
    assert len(bomb) < 10_000
    with pytest.raises(packages.PackageError, match=r"the zip expands to 2097158 bytes, over the limit of 200000 "
                                                    r"\(20x the upload limit of 10000 bytes\); leave data and "
                                                    r"checkpoints out of the code package"):
        packages.save(bomb, tmp_path, max_bytes=10_000)
    assert not list(tmp_path.iterdir())  # nothing half-written
    sha, uri = packages.save(zipped(**{"pkg__model.py": b"x = 1\n"}), tmp_path, max_bytes=10_000)
    assert uri == f"gcs://_ray_pkg_{sha}.zip" and (tmp_path / f"{sha}.zip").exists()

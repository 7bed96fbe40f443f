"""Tokens map to tenants; malformed token settings are refused with a clear message."""
import pytest

from service.auth import LOCAL_TENANT, Authenticator, TokenError, is_loopback, load_tokens, parse_tokens

T1, T2 = "a" * 20, "b" * 24


def test_parse_env_and_file(tmp_path):
    f = tmp_path / "tokens"
    f.write_text(f"# teams\ncarol:{'c' * 16}\n\n")
    tokens = load_tokens(f"alice:{T1}, bob:{T2}", f)
    assert tokens == {T1: "alice", T2: "bob", "c" * 16: "carol"}


@pytest.mark.parametrize("text, message", [
    ("alice", "entry 1 is not 'tenant:token'"),
    (f"alice:{T1},:{T2}", "entry 2 is not 'tenant:token'"),
    ("alice:short", "shorter than 16 characters"),
    (f"alice:{T1},bob:{T1}", "RELAYTRAIN_API_TOKENS: tenants 'alice' and 'bob' are given the same token; each tenant "
                             "needs a token of its own"),  # bob silently had it
])
def test_malformed_tokens(text, message):
    with pytest.raises(TokenError, match=message):
        parse_tokens(text)


def test_missing_tokens_file(tmp_path):
    with pytest.raises(TokenError, match="does not exist"):
        load_tokens("", tmp_path / "nope")


def test_bearer_lookup():
    auth = Authenticator({T1: "alice", T2: "bob"})
    assert auth.tenant_for(f"Bearer {T1}") == "alice"
    assert auth.tenant_for(f"Bearer {T2}") == "bob"
    assert auth.tenant_for(f"Bearer {T1}x") is None
    assert auth.tenant_for(T1) is None  # no scheme
    assert auth.tenant_for(None) is None


def test_without_tokens_everyone_is_local():
    assert Authenticator({}).tenant_for(None) == LOCAL_TENANT


def test_loopback():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1") and not is_loopback("example.com")


# ---------------------------------------------------------------- tenants' weights (the fair shares)

def test_weights_from_tokens_env_and_file(tmp_path):
    from service.auth import load_weights

    f = tmp_path / "weights.yaml"
    f.write_text("bob: 3\n")
    assert load_weights(f"alice:{T1}:2, bob:{T2}", None) == {"alice": 2.0}
    assert load_weights(f"alice:{T1}:2, bob:{T2}", None, "bob:0.5") == {"alice": 2.0, "bob": 0.5}
    assert load_weights(f"alice:{T1}:2, bob:{T2}", None, "", f) == {"alice": 2.0, "bob": 3.0}
    assert parse_tokens(f"alice:{T1}:2") == {T1: "alice"}  # the weight is not part of the token


@pytest.mark.parametrize("tokens, env, message", [
    (f"alice:{T1}:-1", "", "RELAYTRAIN_API_TOKENS: entry 1: the weight of tenant 'alice' must be a positive "
                           "number, not '-1'"),
    (f"alice:{T1}:lots", "", "the weight of tenant 'alice' must be a positive number, not 'lots'"),
    (f"alice:{T1}", "alice:0", "RELAYTRAIN_TENANT_WEIGHTS: the weight of tenant 'alice' must be a positive number"),
    (f"alice:{T1}", "alice", "RELAYTRAIN_TENANT_WEIGHTS: entry 1 is not 'tenant:weight'"),
    # a mistyped tenant got weight 1 without a word, where a weights file naming it is refused (a user trial)
    (f"alice:{T1}", "alice:2,carol:2", r"RELAYTRAIN_TENANT_WEIGHTS names tenant 'carol' that no API token belongs to "
                                       r"\(known: alice\); fix the name or add its token"),
])
def test_bad_weights_say_what_to_change(tokens, env, message):
    from service.auth import load_weights

    with pytest.raises(TokenError, match=message):
        load_weights(tokens, None, env)


def test_weights_file_naming_an_unknown_tenant(tmp_path):
    from service.auth import load_weights

    f = tmp_path / "weights.yaml"
    f.write_text("alice: 2\nmallory: 5\n")
    with pytest.raises(TokenError, match=r"names tenant 'mallory' that no API token belongs to \(known: alice, bob\); "
                                         r"fix the name or add its token"):
        load_weights(f"alice:{T1}, bob:{T2}", None, "", f)
    f.write_text("local: 2\n")  # a server without tokens has one tenant, 'local'
    assert load_weights("", None, "", f) == {"local": 2.0}
    f.write_text("- alice\n")
    with pytest.raises(TokenError, match="must map tenant names to weights"):
        load_weights(f"alice:{T1}", None, "", f)


def test_serve_refuses_bad_weights_in_one_line(tmp_path):
    import subprocess
    import sys

    env = {**__import__("os").environ, "RELAYTRAIN_API_TOKENS": f"alice:{T1}:-2", "RELAYTRAIN_HOME": str(tmp_path)}
    p = subprocess.run([sys.executable, "-m", "api.cli", "serve"], capture_output=True, text=True, env=env,
                       timeout=60)
    assert p.returncode == 2
    assert "relaytrain serve: RELAYTRAIN_API_TOKENS: entry 1: the weight of tenant 'alice' must be a positive" in p.stderr
    assert "Traceback" not in p.stderr


def test_one_token_for_two_tenants_across_the_env_and_the_file_is_refused(tmp_path):
    f = tmp_path / "tokens"
    f.write_text(f"bob:{T1}\n")
    with pytest.raises(TokenError, match=f"{f}: tenants 'alice' and 'bob' are given the same token"):
        load_tokens(f"alice:{T1}", f)
    f.write_text(f"alice:{T1}\n")  # the same tenant twice is no conflict
    assert load_tokens(f"alice:{T1}", f) == {T1: "alice"}


@pytest.mark.parametrize("env, line", [
    ({"RELAYTRAIN_QUEUE_POLICY": "lottery"},
     "relaytrain serve: RELAYTRAIN_QUEUE_POLICY=lottery: Input should be 'elastic', 'fair' or 'fifo'"),
    ({"RELAYTRAIN_MAX_BODY_BYTES": "-5"},
     "relaytrain serve: RELAYTRAIN_MAX_BODY_BYTES=-5: Input should be greater than or equal to 1024"),
])
def test_serve_refuses_bad_settings_in_one_line_naming_the_variable(tmp_path, env, line):
    import os
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "api.cli", "serve"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, **env, "RELAYTRAIN_HOME": str(tmp_path)})
    assert p.returncode == 2 and p.stderr.strip() == line and "Traceback" not in p.stderr


def test_serve_says_which_ray_it_joined_and_that_local_cpus_is_not_applied():
    """`serve` with no --ray-address joins the Ray already running on the machine (its own, from
    before a restart): another user's joined silently, its --local-cpus ignored (a user trial)."""
    from api.jobs import joined_ray_message

    said = joined_ray_message("192.0.2.2:6379", 4.0, 1)
    assert said == ("relaytrain serve: using the Ray already running on this machine at 192.0.2.2:6379 (4 CPU "
                    "slots): this server's own from before a restart, or another program's, whose end would end "
                    "this server within a minute; pass --ray-address to choose a cluster. "
                    "--local-cpus 1 is not applied: it sizes a Ray that serve starts itself (stop this one with "
                    "`ray stop` first, if it is yours and no job of another server runs on it)")
    assert joined_ray_message("192.0.2.2:6379", 4.0, 4).endswith("pass --ray-address to choose a cluster")
    assert joined_ray_message("192.0.2.2:6379", 4.0, None).endswith("pass --ray-address to choose a cluster")


def test_a_tokens_file_edited_under_a_running_server_is_read_again(tmp_path, caplog):
    """A token rotated or revoked in the tokens file counts without a restart (the server read
    the file only at its start: the new token was refused and the revoked ones still let in, a
    user trial).  An emptied or malformed file is not taken: the tokens before stay."""
    import os
    import time

    from fastapi.testclient import TestClient

    from api.app import create_app
    from service.settings import Settings

    new = "c" * 22
    f = tmp_path / "tokens"
    f.write_text(f"alice:{T1}\nbob:{T2}\n")
    app = create_app(Settings(home=tmp_path, tokens_file=f, api_tokens=""), connect_ray=False)

    def status(token):
        return tc.get("/v1/jobs", headers={"Authorization": f"Bearer {token}"}).status_code

    def edit(text):
        f.write_text(text)
        os.utime(f, ns=(time.time_ns(), time.time_ns() + 10**9))  # a new mtime even within the clock's tick
        app.state.auth.reread()  # (as SIGHUP does; otherwise within a second)

    with TestClient(app, raise_server_exceptions=False) as tc:
        assert (status(T1), status(T2), status(new)) == (200, 200, 401)
        edit(f"alice:{new}\n")  # alice's token rotated, bob's revoked
        assert (status(T1), status(T2), status(new)) == (401, 401, 200)
        assert "tokens read again from" in caplog.text and "removed: bob" in caplog.text
        edit("")  # emptied: not taken, the server stays closed
        assert (status(new), status("x" * 20)) == (200, 401)
        assert "now names no tenant; the tokens before it stay in force" in caplog.text
        edit("alice\n")  # malformed: not taken
        assert status(new) == 200
        assert "the tokens file changed but was not taken" in caplog.text
        edit(f"alice:{T1}\n")  # and without reread(): within a second
        deadline = time.monotonic() + 5
        app.state.auth._looked = time.monotonic()
        while status(T1) != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (status(T1), status(new)) == (200, 401)

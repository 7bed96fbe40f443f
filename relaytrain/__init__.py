"""What user code imports from relaytrain: ``relaytrain.skip`` (skip connections across
pipeline stages).  The service itself lives in ``service/``, ``actors/`` and ``api/``."""

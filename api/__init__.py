"""REST control plane (FastAPI); see the control-plane issue."""

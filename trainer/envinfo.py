"""The environment fingerprint moved to guard/runtime/envinfo.py (shared with every integration)."""

from guard.runtime.envinfo import device_name, fingerprint, git_sha, hardware_key

__all__ = ["device_name", "fingerprint", "git_sha", "hardware_key"]

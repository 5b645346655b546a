"""`python -m guard ...` is the `moeguard` command (so `torchrun -m guard train` works)."""

from guard.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

"""moeguard: training observability and stability guard for Mixture-of-Experts LLMs."""

__version__ = "0.1.0"

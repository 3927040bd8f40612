"""The cluster: environment variables of schedulers as TF_CONFIG, the rendezvous, the launcher, and log filtering (no
TensorFlow import)."""

__all__: list[str] = []

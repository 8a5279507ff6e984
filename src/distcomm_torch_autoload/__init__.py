"""torch's autoload hook for distcomm: registers the c10d backend "distcomm" at ``import torch``.

torch calls ``register`` for every entry point of the ``torch.backends`` group while ``import
torch`` runs (after torch.distributed is imported; ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns that
off). It must cost next to nothing: this package lives outside ``distcomm`` so that loading it does
not import distcomm (hundreds of milliseconds); distcomm is imported by the creator, when the first
"distcomm" group is made.
"""


def register() -> None:
    import sys

    tdist = sys.modules.get("torch.distributed")
    if tdist is None or not tdist.is_available():
        return  # a torch built without distributed: nothing to register with
    tdist.Backend.register_backend("distcomm", _create, extended_api=True, devices=["cpu"])


def _create(common_opts, backend_options=None):
    from distcomm.torch_backend import create  # also replaces this registration by the real one

    return create(common_opts, backend_options)

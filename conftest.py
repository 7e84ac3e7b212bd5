"""Root conftest: its presence puts the repository root on sys.path (pytest's rootdir
conftest rule), so ``.venv/bin/pytest tests/unit`` imports ``ds_vshape`` from the working
tree even before the package is installed."""

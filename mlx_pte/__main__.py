"""``python -m mlx_pte``: the same as the ``mlx-pte`` command."""
from mlx_pte.cli import main

raise SystemExit(main())

"""``python -m mergekit_loco`` runs the ``mloco`` command line."""

from mergekit_loco.cli import main

main()

"""``mloco`` with the fault of ``MLOCO_FAULT_AT`` installed (tests/fault_hook.py); run as
``python tests/fault_launcher.py train ...`` or under torchrun in its place."""

import os
import sys

from fault_hook import FAULT_ENV, install

from mergekit_loco.cli import main

if os.environ.get(FAULT_ENV):
    install(os.environ[FAULT_ENV])
main(sys.argv[1:])

"""Runs a script with its Python stacks dumped every 45 s (where a long GPU run spends its time):
``python bench/sessions/stacks.py SCRIPT ARGS...``."""

import faulthandler
import runpy
import sys

faulthandler.dump_traceback_later(45, repeat=True)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")

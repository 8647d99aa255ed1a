"""`tritium` commands: one module per subcommand (main.py dispatches)."""
import os

# Before torch loads its OpenMP runtime (libgomp reads this once, at load): idle OpenMP threads
# sleep instead of spinning. With the default policy, on a host whose cores other processes also
# use, a spinning thread takes the core its busy sibling needs, and every parallel region waits
# a scheduler time slice for it: a GPTQ build ran 5.9x slower beside two busy processes
# (builder/build_threads.py has the measurements). An explicit OMP_WAIT_POLICY is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

"""`python -m tritium.client.cli`."""
import sys

from tritium.client.cli.main import main

sys.exit(main())

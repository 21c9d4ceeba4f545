"""`python -m voicewire_client ...` runs the CLI."""

import sys

from voicewire_client.cli import main

sys.exit(main())

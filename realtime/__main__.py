"""`python -m voicewire.realtime serve ...`"""

import sys

from voicewire.realtime.cli import main

sys.exit(main())

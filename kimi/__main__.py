import sys

from kimi.cli import main

sys.exit(main())

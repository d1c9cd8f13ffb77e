import sys

from wcd.cli.wcd import main

sys.exit(main())

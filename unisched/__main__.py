import sys

from unisched.cli import main

sys.exit(main())

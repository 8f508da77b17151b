import sys

from specdec.gateway.entrypoint import main

sys.exit(main())

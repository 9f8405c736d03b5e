"""`python -m colozoo.finetune ...` (what torchrun launches): the same options as `colozoo finetune`."""
import sys

from colozoo.finetune import main

sys.exit(main())

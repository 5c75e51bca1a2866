"""``python -m fedtune.cli``."""

from fedtune.cli import main

if __name__ == "__main__":
    main()

"""wanexp training entry point: python train.py [group=option ...] [key=value ...] (see README.md)."""
from wanexp.train import main

if __name__ == "__main__":
    main()

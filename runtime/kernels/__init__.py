"""One kernel per module; ``base`` holds the contract every kernel implements."""

"""placeholder"""


def register(subparsers):
    pass

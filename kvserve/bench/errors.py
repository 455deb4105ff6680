"""The one exception the load tester raises for a user's mistake; the CLI prints it as one line."""


class BenchError(Exception):
    pass

"""The command line: one small module per command, parsing arguments and calling the library."""

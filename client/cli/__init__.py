"""`tritium` commands: one module per subcommand (main.py dispatches)."""

"""The `loadmaster` command line: up, status and admin commands."""

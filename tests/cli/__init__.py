"""The command line as one tool: names, help, console text, typed refusals."""

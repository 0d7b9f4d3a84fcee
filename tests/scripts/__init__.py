"""Programs the tests run in a process of their own (a fresh hash seed, a world of one, a
default device set once, a process to SIGKILL): each a real module, run as
``python -m tests.scripts.<name> <args>`` from the repository root, so a reader, the linter
and the type checker see them like any other code. Each says which test runs it and what
it prints."""

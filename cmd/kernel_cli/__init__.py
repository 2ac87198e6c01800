"""The `kernel` command line: the one place that wires batteries and adapters to the kernel."""

"""The benchmark scripts in bench/ run and measure what they claim."""

"""The signed release: export, verify, report, synthesize, certificates and the light install."""

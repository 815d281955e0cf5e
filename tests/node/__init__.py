"""The site node: its release protocol, worker, resources, state, site cache and onboarding kit."""

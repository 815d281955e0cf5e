"""Privacy accounting: composition, planning, the patient unit, derived jobs and the site ledger."""

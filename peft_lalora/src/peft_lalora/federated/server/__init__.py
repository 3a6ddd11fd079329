"""The server: rounds, aggregation, the privacy ledger, the plan, reply parsing, evaluation."""

"""The plan contract: the Plan record, plan.json's schema and versions, and the rules
both the search and the runtime read. It searches, prices and runs nothing."""

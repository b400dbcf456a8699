"""The service's plan room: the machines a sweep can run on, what a pack needs of them, and what the dry run prints."""

"""The service's plan room: the machines a sweep can name, what a pack needs of them, and the bill the dry run prints."""

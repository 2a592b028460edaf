"""A user's own training script, unchanged, as a cell: its command line per split (placeholders),
the probe loaded into its processes (what it really optimised, on which data, with which events),
and how a cell of it is launched."""

"""What a command runs on and how it reports: the device (``device``), the work a command
may ask of the machine, priced before it starts (``budget``), and progress bars
(``progress``)."""

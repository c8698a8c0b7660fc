"""The step's optional features behind one protocol (``protocol``). A part of its own, below
the core and the parts that implement features: it imports neither, so each of them can
implement the protocol without an import cycle."""

"""The demos behind ``alma-demo`` (``make demo``) and ``alma-vision-demo``.

Each demo is a list of real commands a user could type (``steps``), run one after the other
with their output logged, so the library here only decides which commands and how to read
their results; ``cli/demo.py`` and ``cli/vision_demo.py`` parse flags and call in.
"""

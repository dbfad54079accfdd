"""Tables and figures of stream results, the way the paper shows them (``alma-report``,
``alma-score``, the demos): ``inputs`` reads runs, ``seeds`` groups runs that differ only by
seed, ``tables`` renders Table 2 / the CER table, ``figures`` Figs. 2-5.  No fairseq or torch
import: reports are drawn wherever the run directories are."""

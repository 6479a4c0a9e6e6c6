"""Installing specserve where there is no package index: `specserve wheelhouse` builds a folder of wheels beside it."""

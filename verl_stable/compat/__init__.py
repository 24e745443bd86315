"""Everything verl-stable does to third-party packages, in one place: the catalogue of patches and private methods
overridden (:mod:`.catalogue`), the contract machinery that checks each (:mod:`.contracts`), and the import hooks
that defer a registration until verl imports a module (:mod:`.import_hooks`)."""

"""Files a flag names: the checked reading of any of them (parsed once while unchanged, errors naming the
flag and the file), and the head-score file format."""

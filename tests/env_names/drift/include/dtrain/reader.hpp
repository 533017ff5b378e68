// Reads DTRAIN_A by its spelling, not its constant, and names DTRAIN_GONE, which is no variable.
inline const char* reader() { return "DTRAIN_A"; }

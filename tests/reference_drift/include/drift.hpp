// A fixture of docs.catches_reference_drift: an options struct whose field
// `b` has no row in docs/reference.md here, which has a row for a field `c`
// that is gone.
struct drift_options {
  int a = 1;
  /// A field without a row.
  int b{};
  static constexpr int not_a_field = 3;
  int method() const;
};

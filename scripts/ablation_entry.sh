# Sourced by scripts/parity.sh and scripts/parity_branch.sh: how an ABLATIONS entry becomes a run.
#   variant ENTRY → "SUFFIX OVERRIDE": an entry with '=' is one Hydra override (suffix: the override with '=' → '-'
#   and anything but [A-Za-z0-9_.-] → '_'); otherwise comma-joined fp8.ablate components (suffix: ',' → '+').
variant() {
  if [[ $1 == *=* ]]; then local s=${1//=/-}; echo "${s//[^A-Za-z0-9_.-]/_} $1"; else echo "${1//,/+} fp8.ablate=[$1]"; fi
}

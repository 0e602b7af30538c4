//! Reads `kernels/launch_config.cuh`: every `TP_CONST(NAME, VALUE)` line, VALUE an integer
//! literal. Shared by the build script (which turns them into Rust constants for tp-kernels) and
//! `cargo xtask ptx` (which checks the register split against ptxas): one parser, one source.

/// `(NAME, VALUE)` for every `TP_CONST` line of `text`, in order; an error names a bad line.
pub fn parse(text: &str) -> Result<Vec<(String, u32)>, String> {
    let mut out = Vec::new();
    for (no, line) in text.lines().enumerate() {
        let Some(rest) = line.trim().strip_prefix("TP_CONST(") else { continue };
        if rest.starts_with("NAME") {
            continue; // the macro's own definition
        }
        let body = rest.strip_suffix(')').ok_or_else(|| format!("line {}: no closing parenthesis", no + 1))?;
        let (name, value) = body.split_once(',').ok_or_else(|| format!("line {}: expected NAME, VALUE", no + 1))?;
        let (name, value) = (name.trim(), value.trim());
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_') {
            return Err(format!("line {}: {name:?} is not an UPPER_CASE name", no + 1));
        }
        let value =
            value.parse::<u32>().map_err(|_| format!("line {}: {value:?} is not an integer literal", no + 1))?;
        out.push((name.to_string(), value));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_constants_and_rejects_expressions() {
        let text = "#define TP_CONST(NAME, VALUE) constexpr int NAME = VALUE;\nTP_CONST(A_B, 128)\n  TP_CONST(C, 7)\n";
        assert_eq!(super::parse(text).unwrap(), vec![("A_B".to_string(), 128), ("C".to_string(), 7)]);
        assert!(super::parse("TP_CONST(X, 2 * 3)").is_err());
        assert!(super::parse("TP_CONST(lower, 1)").is_err());
    }

    #[test]
    fn the_committed_header_parses() {
        let text = std::fs::read_to_string(crate::workspace_root().join("kernels/launch_config.cuh")).unwrap();
        let consts = super::parse(&text).unwrap();
        assert!(consts.iter().any(|(n, v)| n == "WGMMA_SMEM_BYTES" && *v > 0));
    }
}

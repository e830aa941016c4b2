//! Lower-case hexadecimal text of bytes: fingerprints, token hashes, signatures.

const DIGITS: &[u8; 16] = b"0123456789abcdef";

/// Two lower-case hex digits per byte. A fingerprint is computed for every mutating
/// request, so this writes into one buffer instead of formatting byte by byte.
pub fn lower_hex(bytes: &[u8]) -> String {
    let mut text = String::with_capacity(bytes.len() * 2);
    push_lower_hex(&mut text, bytes);
    text
}

/// [`lower_hex`] appended to `text`.
pub fn push_lower_hex(text: &mut String, bytes: &[u8]) {
    for byte in bytes {
        text.push(char::from(DIGITS[usize::from(byte >> 4)]));
        text.push(char::from(DIGITS[usize::from(byte & 0x0f)]));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_byte_becomes_two_lower_case_digits_high_nibble_first() {
        assert_eq!(lower_hex(&[]), "");
        assert_eq!(lower_hex(&[0x00, 0x0f, 0xa0, 0xff, 0x3c]), "000fa0ff3c");
        let every_byte: Vec<u8> = (0..=255).collect();
        let expected: String = every_byte
            .iter()
            .map(|byte| format!("{byte:02x}"))
            .collect();
        assert_eq!(lower_hex(&every_byte), expected);
    }
}

//! The `rans` value codec: bit-pattern differences entropy-coded with a static rANS coder over a per-tensor
//! frequency table (docs/format.md §6.2).
//!
//! A difference `d` is sign-extended to `s` and zigzagged to `u` (0, -1, 1, -2, 2, ... -> 0, 1, 2, 3, 4, ...).
//! Values of `u` below 16 are tokens of their own; larger ones are a token for their bit length and the two bits
//! after the leading one, followed by the remaining low bits, coded as uniform symbols in the same state.

use super::elements::{mask, unzigzag, zigzag};
use super::values::ESCAPE;

/// Probabilities are in units of 2^-PROB_BITS.
pub const PROB_BITS: u32 = 12;
pub const PROB_SCALE: u32 = 1 << PROB_BITS;
/// The state lies in [STATE_LOW, 256 * STATE_LOW) between symbols; the encoder starts and the decoder ends here.
pub const STATE_LOW: u32 = 1 << 23;
/// `u` below this is a token of its own.
const DIRECT: u64 = 16;
/// Low bits beyond a token are coded in chunks of at most this many bits.
const CHUNK_BITS: u32 = 16;
/// Tokens for every element width (32 per byte of the width).
pub const MAX_TOKENS: usize = 256;

/// How many tokens `W`-byte elements have: 16 direct ones, and 4 per bit length from 5 to 8W bits.
pub const fn token_count(width: usize) -> usize {
    32 * width
}

/// The code of a wrapping difference of a `width`-byte element: its zigzag code, except that `d = 0` (never a
/// change) and `d = 2^(8W-1)` (a flip of the top bit, a float's sign) swap codes, so that a sign flip costs a token
/// and no low bits.
#[inline(always)]
pub fn code_of(difference: u64, width: usize) -> u64 {
    let z = zigzag(difference, width);
    if z == 0 {
        mask(width)
    } else if z == mask(width) {
        0
    } else {
        z
    }
}

/// The wrapping difference of a `W`-byte element with code `u`.
#[inline(always)]
fn difference_of<const W: usize>(u: u64) -> u64 {
    let z = if u == 0 {
        mask(W)
    } else if u == mask(W) {
        0
    } else {
        u
    };
    unzigzag(z) & mask(W)
}

/// The token of a zigzag code, and how many low bits follow it.
#[inline(always)]
pub const fn token_of(u: u64) -> (u8, u32) {
    if u < DIRECT {
        return (u as u8, 0);
    }
    let length = 63 - u.leading_zeros(); // position of the leading one, 4..=63
    let after_leading = ((u >> (length - 2)) & 3) as u32;
    ((16 + 4 * (length - 4) + after_leading) as u8, length - 2)
}

/// The low bits that follow `token`, and the value of the token's code with those bits zero.
#[inline(always)]
fn token_parts(token: u8) -> (u32, u64) {
    if u64::from(token) < DIRECT {
        return (0, u64::from(token));
    }
    let t = u32::from(token) - 16;
    let low_bits = 2 + t / 4;
    (low_bits, u64::from(4 + t % 4) << low_bits)
}

/// A range's differences as tokens, with the low bits of the tokens that have them, in order.
#[derive(Default)]
pub struct Tokens {
    pub tokens: Vec<u8>,
    pub low_bits: Vec<u64>,
    /// How many of the differences the `diff` stream escaped.
    pub escapes: u64,
}

/// The token and low bits of each byte of a `diff` stream of wide elements (but the escape byte and 0, whose codes
/// depend on the width): (token, low bits, number of low bits).
static BYTE_TOKENS: [(u8, u8, u8); 256] = {
    let mut table = [(0u8, 0u8, 0u8); 256];
    let mut byte = 0;
    while byte < 256 {
        // A one-byte `diff` value is the difference sign-extended from its byte, whatever the width.
        let u = zigzag(byte as u64, 1);
        let (token, bits) = token_of(u);
        table[byte] = (token, (u & ((1 << bits) - 1)) as u8, bits as u8);
        byte += 1;
    }
    table
};

/// Token counts are kept in this many tables, value `i` counted in table `i mod COUNT_LANES`: most values are ±1
/// (two tokens), and an increment of the counter just incremented would wait for that store.
const COUNT_LANES: usize = 4;
/// Values are tokenised in blocks of this many; a block's low bits are gathered in a local buffer, without a
/// branch on which values have them, and appended once.
const BLOCK: usize = 32;

/// The token of a `diff` value other than a one-byte difference of a wide element (`BYTE_TOKENS`), read at `*at`
/// after its first byte `byte`: (token, its low bits, whether it has any).
#[inline(always)]
fn rare_diff_token<const W: usize>(byte: u8, stream: &[u8], at: &mut usize, escapes: &mut u64) -> (u8, u64, bool) {
    let difference = if W > 1 && byte == ESCAPE {
        let mut word = [0u8; 8];
        word[..W].copy_from_slice(&stream[*at..*at + W]);
        *at += W;
        *escapes += 1;
        u64::from_le_bytes(word)
    } else {
        u64::from(byte)
    };
    let u = code_of(difference, W);
    let (token, bits) = token_of(u);
    (token, u & ((1u64 << bits) - 1), bits > 0)
}

/// Tokenises a byte-coded `diff` value stream of `count` differences of `W`-byte elements, counting each token in
/// `histogram`.
pub fn tokenize_diff<const W: usize>(diff_stream: &[u8], count: u64, histogram: &mut [u64; MAX_TOKENS]) -> Tokens {
    let mut tokens = vec![0u8; count as usize];
    let (mut low_bits, mut escapes) = (Vec::new(), 0);
    let mut counts = [[0u64; MAX_TOKENS]; COUNT_LANES];
    let mut at = 0;
    for block in tokens.chunks_mut(BLOCK) {
        let (mut lows, mut lows_len) = ([0u64; BLOCK], 0);
        for (index, slot) in block.iter_mut().enumerate() {
            let byte = diff_stream[at];
            at += 1;
            let (token, low, has_low) = if W > 1 && byte != ESCAPE && byte != 0 {
                let (token, low, bits) = BYTE_TOKENS[usize::from(byte)];
                (token, u64::from(low), bits > 0)
            } else {
                rare_diff_token::<W>(byte, diff_stream, &mut at, &mut escapes)
            };
            *slot = token;
            counts[index % COUNT_LANES][usize::from(token)] += 1;
            lows[lows_len] = low;
            lows_len += usize::from(has_low);
        }
        low_bits.extend_from_slice(&lows[..lows_len]);
    }
    for lane in &counts {
        for (total, count) in histogram[..token_count(W)].iter_mut().zip(lane) {
            *total += count;
        }
    }
    Tokens { tokens, low_bits, escapes }
}

/// Token frequencies summing to `PROB_SCALE`, every counted token at least 1, from the counts of `W`-byte elements'
/// tokens (not all zero); the list ends at the last counted token.
pub fn normalise(histogram: &[u64; MAX_TOKENS]) -> Vec<u32> {
    let used = histogram.iter().rposition(|&c| c > 0).map_or(0, |last| last + 1);
    let total: u64 = histogram.iter().sum();
    assert!(total > 0, "no token to normalise");
    let mut freqs: Vec<u32> = histogram[..used]
        .iter()
        .map(|&c| {
            if c == 0 {
                0
            } else {
                // Rounded to nearest; u128 keeps count * scale exact.
                let scaled = (u128::from(c) * u128::from(PROB_SCALE) + u128::from(total) / 2) / u128::from(total);
                (scaled as u32).max(1)
            }
        })
        .collect();
    let mut sum: u32 = freqs.iter().sum();
    // Rounding leaves the sum a little off: take from or give to the largest frequencies, which lose the least.
    while sum > PROB_SCALE {
        let largest = (0..used).max_by_key(|&t| (freqs[t], std::cmp::Reverse(t))).expect("a token");
        freqs[largest] -= 1;
        sum -= 1;
    }
    while sum < PROB_SCALE {
        let largest = (0..used).max_by_key(|&t| (histogram[t], std::cmp::Reverse(t))).expect("a token");
        freqs[largest] += 1;
        sum += 1;
    }
    freqs
}

/// Bytes the stream of these counts would take with these frequencies, from their information content: within a
/// few bytes of the real length.
pub fn estimated_len(histogram: &[u64; MAX_TOKENS], freqs: &[u32]) -> f64 {
    let mut bits = 0f64;
    for (token, (&count, &freq)) in histogram.iter().zip(freqs).enumerate() {
        if count > 0 {
            let low_bits = token_parts(token as u8).0;
            bits += count as f64 * (f64::from(PROB_BITS) - f64::from(freq).log2() + f64::from(low_bits));
        }
    }
    table_len(freqs) as f64 + 4.0 + bits / 8.0
}

fn table_len(freqs: &[u32]) -> usize {
    1 + freqs.iter().map(|&f| if f < 0x80 { 1 } else { 2 }).sum::<usize>()
}

/// Appends the frequency table: the number of entries less one, then each frequency in one byte (below 128) or two
/// (`0x80 | f & 0x7f`, then `f >> 7`).
fn write_table(out: &mut Vec<u8>, freqs: &[u32]) {
    out.push((freqs.len() - 1) as u8);
    for &f in freqs {
        if f < 0x80 {
            out.push(f as u8);
        } else {
            out.push(0x80 | (f & 0x7f) as u8);
            out.push((f >> 7) as u8);
        }
    }
}

/// The bytes the encoder's two states shift out, in reverse of the order they are read in: the first `len` bytes of
/// `bytes`, which are written two at a time.
struct Reversed {
    bytes: Vec<u8>,
    len: usize,
}

impl Reversed {
    /// `state` (below 2^31) with its low bytes shifted out while it is at or above `limit` (at least 2^15, so at
    /// most two bytes go): both candidates are stored and `len` moves by how many went, with no branch on that
    /// count, which varies from value to value as the encoder's states do.
    #[inline(always)]
    fn shift_out(&mut self, state: u32, limit: u32) -> u32 {
        debug_assert!(state < 1 << 31 && limit >= 1 << 15);
        let count = usize::from(state >= limit) + usize::from(u64::from(state) >= u64::from(limit) << 8);
        if self.len + 2 > self.bytes.len() {
            self.bytes.resize(2 * self.bytes.len() + 16, 0);
        }
        self.bytes[self.len..self.len + 2].copy_from_slice(&(state as u16).to_le_bytes());
        self.len += count;
        state >> (8 * count)
    }

    /// `state` after encoding `bits <= CHUNK_BITS` uniform low bits.
    #[inline(always)]
    fn put_bits(&mut self, state: u32, value: u64, bits: u32) -> u32 {
        (self.shift_out(state, 1 << (31 - bits)) << bits) | value as u32
    }

    /// `state` after encoding a token.
    #[inline(always)]
    fn put_token(&mut self, state: u32, symbol: &EncodeSymbol) -> u32 {
        symbol.next_state(self.shift_out(state, symbol.limit))
    }
}

/// A token as the encoder takes it: `x -> (x div f) * M + x mod f + c` computed with a multiplication by a
/// reciprocal instead of a division (exact for x below 2^31, as F. Giesen's ryg_rans shows).
#[derive(Clone, Copy, Default)]
struct EncodeSymbol {
    /// Bytes are shifted out while the state is at or above this (`f << 19`).
    limit: u32,
    reciprocal: u32,
    shift: u32,
    bias: u32,
    complement: u32,
    /// How many low bits follow the token (`token_parts`).
    low_bits: u32,
}

impl EncodeSymbol {
    /// The symbol of `token`, of frequency `freq`, whose slots begin at `start`.
    fn new(token: u8, freq: u32, start: u32) -> Self {
        let low_bits = token_parts(token).0;
        let limit = freq << (23 - PROB_BITS + 8);
        let complement = PROB_SCALE - freq;
        if freq < 2 {
            // x div 1 = x: the reciprocal 2^32 - 1 gives x - 1, which the bias makes up for.
            let bias = start + PROB_SCALE - 1;
            return EncodeSymbol { limit, reciprocal: u32::MAX, shift: 32, bias, complement, low_bits };
        }
        let bits = 32 - (freq - 1).leading_zeros(); // ceil(log2 freq)
        let reciprocal = (1u64 << (bits + 31)).div_ceil(u64::from(freq)) as u32;
        EncodeSymbol { limit, reciprocal, shift: 32 + bits - 1, bias: start, complement, low_bits }
    }

    #[inline(always)]
    fn next_state(&self, state: u32) -> u32 {
        let quotient = ((u64::from(state) * u64::from(self.reciprocal)) >> self.shift) as u32;
        state + self.bias + quotient * self.complement
    }
}

/// The `rans` stream of the tokens of a tensor's consecutive ranges, with the frequencies `normalise` gave for their
/// counts.
pub fn encode(parts: &[&Tokens], freqs: &[u32]) -> Vec<u8> {
    let mut symbols = [EncodeSymbol::default(); MAX_TOKENS];
    let mut start = 0;
    for (token, (symbol, &f)) in symbols.iter_mut().zip(freqs).enumerate() {
        if f > 0 {
            *symbol = EncodeSymbol::new(token as u8, f, start);
        }
        start += f;
    }
    let total: usize = parts.iter().map(|p| p.tokens.len()).sum();
    let mut reversed = Reversed { bytes: vec![0; total / 3 + 16], len: 0 };
    // Backwards: the decoder reads the last symbol encoded first. Value `i` (counting from 0 over all parts) is
    // coded in state `i mod 2`, so that a decoder's two chains of dependent steps overlap: `state` codes the value
    // encoded next, `other` the one before it, and the two swap after each value (as locals, not an array indexed
    // by `i`, so that both stay in registers).
    let (mut state, mut other) = (STATE_LOW, STATE_LOW);
    for part in parts.iter().rev() {
        let mut low_at = part.low_bits.len();
        for &token in part.tokens.iter().rev() {
            let symbol = &symbols[usize::from(token)];
            let low_bits = symbol.low_bits;
            // A branch, not an empty chunk put for every token: that put would lengthen each state's chain of
            // dependent steps, which bounds the encoder (it took twice as long).
            if low_bits > 0 {
                low_at -= 1;
                let low = part.low_bits[low_at];
                // Chunks are read least significant first, so the most significant is encoded first.
                let mut chunk_start = (low_bits - 1) / CHUNK_BITS * CHUNK_BITS;
                loop {
                    let bits = (low_bits - chunk_start).min(CHUNK_BITS);
                    state = reversed.put_bits(state, (low >> chunk_start) & ((1 << bits) - 1), bits);
                    if chunk_start == 0 {
                        break;
                    }
                    chunk_start -= CHUNK_BITS;
                }
            }
            state = reversed.put_token(state, symbol);
            std::mem::swap(&mut state, &mut other);
        }
    }
    // Value 0 was coded last, in what is now `other`.
    let mut out = Vec::with_capacity(table_len(freqs) + 8 + reversed.len);
    write_table(&mut out, freqs);
    out.extend_from_slice(&other.to_le_bytes());
    out.extend_from_slice(&state.to_le_bytes());
    out.extend(reversed.bytes[..reversed.len].iter().rev());
    out
}

/// The decoding tables of one stream.
struct Model {
    /// The token of each of the `PROB_SCALE` slots.
    slot_token: [u8; PROB_SCALE as usize],
    freq: [u32; MAX_TOKENS],
    start: [u32; MAX_TOKENS],
}

/// Decodes a `rans` value stream one value at a time, checking every read against the end of the stream.
pub struct RansReader<'a> {
    bytes: &'a [u8],
    at: usize,
    /// The state the next value is decoded in, and the other one (values alternate between the two).
    state: u32,
    other: u32,
    /// None for an empty stream (a tensor with no change), from which no value can be read.
    model: Option<Box<Model>>,
}

const EARLY: &str = "value stream ends early";

impl<'a> RansReader<'a> {
    /// Reads the frequency table and the initial state of a stream of `width`-byte elements' differences.
    pub fn new(bytes: &'a [u8], width: usize) -> Result<Self, String> {
        if bytes.is_empty() {
            return Ok(RansReader { bytes, at: 0, state: STATE_LOW, other: STATE_LOW, model: None });
        }
        let entries = usize::from(bytes[0]) + 1;
        if entries > token_count(width) {
            return Err(format!(
                "rans table of {entries} entries, over the {} tokens of {width}-byte elements",
                token_count(width)
            ));
        }
        let mut model =
            Box::new(Model { slot_token: [0; PROB_SCALE as usize], freq: [0; MAX_TOKENS], start: [0; MAX_TOKENS] });
        let mut at = 1;
        let mut sum = 0u32;
        for token in 0..entries {
            let &first = bytes.get(at).ok_or(EARLY)?;
            at += 1;
            let freq = if first < 0x80 {
                u32::from(first)
            } else {
                let &second = bytes.get(at).ok_or(EARLY)?;
                at += 1;
                let freq = u32::from(first & 0x7f) | (u32::from(second) << 7);
                if !(0x80..=PROB_SCALE).contains(&freq) {
                    return Err(format!("rans frequency {freq} is out of range or not in its shortest form"));
                }
                freq
            };
            if sum + freq > PROB_SCALE {
                return Err(format!("rans frequencies sum to more than {PROB_SCALE}"));
            }
            model.freq[token] = freq;
            model.start[token] = sum;
            model.slot_token[sum as usize..(sum + freq) as usize].fill(token as u8);
            sum += freq;
        }
        if sum != PROB_SCALE {
            return Err(format!("rans frequencies sum to {sum}, not {PROB_SCALE}"));
        }
        if model.freq[entries - 1] == 0 {
            return Err("rans table ends with a zero frequency".to_owned());
        }
        let mut states = [0u32; 2];
        for state in &mut states {
            let four = bytes.get(at..at + 4).ok_or(EARLY)?;
            *state = u32::from_le_bytes(four.try_into().expect("4 bytes"));
            if !(STATE_LOW..STATE_LOW << 8).contains(state) {
                return Err(format!("rans initial state {state:#x} is out of range"));
            }
            at += 4;
        }
        Ok(RansReader { bytes, at, state: states[0], other: states[1], model: Some(model) })
    }

    /// The next difference, as the low `W` bytes of a u64.
    #[inline(always)]
    pub fn next_value<const W: usize>(&mut self) -> Result<u64, String> {
        let model = self.model.as_deref().ok_or(EARLY)?;
        let value = decode_value::<W>(model, self.bytes, &mut self.at, &mut self.state)?;
        std::mem::swap(&mut self.state, &mut self.other);
        Ok(value)
    }

    /// Fills `out` with the next values, as `next_value` would one by one: two at a time, one in each state, so
    /// that the two chains of dependent steps overlap.
    pub fn read_values<const W: usize>(&mut self, out: &mut [u64]) -> Result<(), String> {
        let model = self.model.as_deref().ok_or(EARLY)?;
        let bytes = self.bytes;
        let (mut at, mut first, mut second) = (self.at, self.state, self.other);
        let mut pairs = out.chunks_exact_mut(2);
        let mut result = Ok(());
        for pair in &mut pairs {
            let one = decode_value::<W>(model, bytes, &mut at, &mut first);
            let two = decode_value::<W>(model, bytes, &mut at, &mut second);
            match (one, two) {
                (Ok(one), Ok(two)) => (pair[0], pair[1]) = (one, two),
                (Err(e), _) | (_, Err(e)) => {
                    result = Err(e);
                    break;
                }
            }
        }
        if result.is_ok() {
            if let [last] = pairs.into_remainder() {
                match decode_value::<W>(model, bytes, &mut at, &mut first) {
                    Ok(value) => *last = value,
                    Err(e) => result = Err(e),
                }
                std::mem::swap(&mut first, &mut second);
            }
        }
        (self.at, self.state, self.other) = (at, first, second);
        result
    }

    /// The most values the rest of the stream can hold, or None where a value takes no bits (a table of one
    /// token without low bits, at frequency `PROB_SCALE`: every value is that token and nothing is read).
    ///
    /// Decoding a token of frequency `f` from a state `x = PROB_SCALE q + s` (q >= 2^11, as x >= STATE_LOW) leaves
    /// `f q + s - start`, at least `(PROB_SCALE - f) q` less: `log2 x` falls by more than `(PROB_SCALE - f) /
    /// PROB_SCALE` bits, and low bits take one bit each or more. Each of the two states holds at most 31 bits and
    /// gains 8 per byte shifted in, so with `f_max` the largest frequency the stream holds at most
    /// `(62 + 8 bytes) PROB_SCALE / (PROB_SCALE - f_max)` values (`PROB_SCALE - f_max` taken as 1 for a lone token
    /// with low bits). A check can refuse a larger count before decoding (a hostile file declaring 2^50 values of a
    /// near-free table would otherwise keep it decoding for days).
    pub fn most_values(&self) -> Option<u64> {
        let Some(model) = self.model.as_deref() else {
            return Some(0); // an empty stream
        };
        let (token, &f_max) = model.freq.iter().enumerate().max_by_key(|(_, &f)| f).expect("a table");
        if f_max == PROB_SCALE && (token as u64) < DIRECT {
            return None;
        }
        let budget = 62 + 8 * (self.bytes.len() - self.at) as u128;
        let most = budget * u128::from(PROB_SCALE) / u128::from((PROB_SCALE - f_max).max(1)) + 1;
        Some(u64::try_from(most).unwrap_or(u64::MAX))
    }

    /// True when every byte has been read and the state is back where the encoder started.
    pub fn is_exhausted(&self) -> bool {
        self.at == self.bytes.len() && (self.model.is_none() || (self.state == STATE_LOW && self.other == STATE_LOW))
    }
}

/// Decodes one value in `state`, reading renormalisation bytes from `bytes` at `at`.
#[inline(always)]
fn decode_value<const W: usize>(model: &Model, bytes: &[u8], at: &mut usize, state: &mut u32) -> Result<u64, String> {
    let slot = *state & (PROB_SCALE - 1);
    let token = model.slot_token[slot as usize];
    let t = usize::from(token);
    *state = model.freq[t] * (*state >> PROB_BITS) + slot - model.start[t];
    // At most two bytes after a token (its frequency is at least 1, so the state is at least 2^11): shifted in
    // without a branch on how many while two bytes remain, else one at a time below.
    if let Some(&[b0, b1]) = bytes.get(*at..*at + 2) {
        let n = u32::from(*state < STATE_LOW) + u32::from(*state < STATE_LOW >> 8);
        let two = u32::from(b0) << 8 | u32::from(b1);
        *state = (*state << (8 * n)) | (two >> (8 * (2 - n)));
        *at += n as usize;
    }
    while *state < STATE_LOW {
        let &byte = bytes.get(*at).ok_or(EARLY)?;
        *at += 1;
        *state = (*state << 8) | u32::from(byte);
    }
    if u64::from(token) < DIRECT {
        return Ok(difference_of::<W>(u64::from(token)));
    }
    let (low_bits, base) = token_parts(token);
    Ok(difference_of::<W>(base | read_low_bits(bytes, at, state, low_bits)?))
}

/// Reads `low_bits` low bits in chunks, least significant first, renormalising after each.
fn read_low_bits(bytes: &[u8], at: &mut usize, state: &mut u32, low_bits: u32) -> Result<u64, String> {
    let (mut value, mut read) = (0u64, 0);
    while read < low_bits {
        let bits = (low_bits - read).min(CHUNK_BITS);
        value |= u64::from(*state & ((1 << bits) - 1)) << read;
        *state >>= bits;
        while *state < STATE_LOW {
            let &byte = bytes.get(*at).ok_or(EARLY)?;
            *at += 1;
            *state = (*state << 8) | u32::from(byte);
        }
        read += bits;
    }
    Ok(value)
}

/// Checks that a `rans` value stream of `W`-byte elements holds exactly `changed` values and ends as the encoder
/// ends, by decoding it.
pub fn check_rans<const W: usize>(bytes: &[u8], changed: u64) -> Result<(), String> {
    let mut reader = RansReader::new(bytes, W)?;
    let mut batch = [0u64; 256];
    let mut left = changed;
    if changed > 0 {
        match reader.most_values() {
            // Values that take no bits: decoding them would change nothing, however many.
            None => left = 0,
            Some(most) if changed > most => {
                return Err(format!("value stream of {} bytes cannot hold {changed} values", bytes.len()))
            }
            Some(_) => {}
        }
    }
    while left > 0 {
        let n = left.min(batch.len() as u64) as usize;
        reader.read_values::<W>(&mut batch[..n])?;
        left -= n as u64;
    }
    if reader.at != reader.bytes.len() {
        return Err("value stream has bytes after the last change".to_owned());
    }
    if !reader.is_exhausted() {
        return Err("rans stream does not end in the encoder's initial state".to_owned());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Encodes differences of `W`-byte elements as one range.
    fn encode_differences<const W: usize>(differences: &[u64]) -> Vec<u8> {
        let mut histogram = [0u64; MAX_TOKENS];
        let mut tokens = Tokens::default();
        for &d in differences {
            let u = code_of(d & mask(W), W);
            let (token, bits) = token_of(u);
            tokens.tokens.push(token);
            histogram[usize::from(token)] += 1;
            if bits > 0 {
                tokens.low_bits.push(u & ((1 << bits) - 1));
            }
        }
        encode(&[&tokens], &normalise(&histogram))
    }

    #[test]
    fn most_values_bounds_what_the_encoder_writes_and_refuses_more() {
        // Skewed to the limit: one value of another token among many (f_max = 4095), and a lone token.
        for (n, odd) in [(1usize, None), (3, None), (200_000, None), (200_000, Some(7usize)), (5, Some(0))] {
            let differences: Vec<u64> = (0..n).map(|i| if Some(i) == odd { 0xfffe } else { 1 }).collect();
            let stream = encode_differences::<2>(&differences);
            let reader = RansReader::new(&stream, 2).unwrap();
            match reader.most_values() {
                None => assert!(odd.is_none(), "a lone token without low bits takes no bits"),
                Some(most) => assert!(most >= n as u64, "{n} values, bound {most}"),
            }
            check_rans::<2>(&stream, n as u64).unwrap();
            // One more: a free stream holds any number; any other is found short.
            assert_eq!(check_rans::<2>(&stream, n as u64 + 1).is_err(), reader.most_values().is_some());
        }
        // A near-free table whose stream holds only its states: refused at once for a count it cannot hold.
        let near = [0x01, 0xff, 0x1f, 0x01, 0, 0, 0x80, 0, 0, 0, 0x80, 0];
        let most = RansReader::new(&near, 2).unwrap().most_values().unwrap();
        assert!(most < 1 << 20, "{most}");
        let error = check_rans::<2>(&near, 1 << 50).unwrap_err();
        assert!(error.contains("cannot hold"), "{error}");
        // A free table: any count is checked without decoding.
        let free = [0x00, 0x80, 0x20, 0, 0, 0x80, 0, 0, 0, 0x80, 0];
        check_rans::<2>(&free, 1 << 50).unwrap();
        assert_eq!(RansReader::new(&[], 2).unwrap().most_values(), Some(0));
    }

    fn decode<const W: usize>(stream: &[u8], n: usize) -> Result<Vec<u64>, String> {
        check_rans::<W>(stream, n as u64)?;
        let mut reader = RansReader::new(stream, W)?;
        let one_by_one: Vec<u64> = (0..n).map(|_| reader.next_value::<W>()).collect::<Result<_, _>>()?;
        // In batches, as apply reads them.
        let mut reader = RansReader::new(stream, W)?;
        let mut batched = vec![0u64; n];
        for batch in batched.chunks_mut(7) {
            reader.read_values::<W>(batch)?;
        }
        assert!(reader.is_exhausted());
        assert_eq!(batched, one_by_one);
        Ok(one_by_one)
    }

    fn roundtrip<const W: usize>(differences: &[u64]) -> Vec<u8> {
        let stream = encode_differences::<W>(differences);
        let want: Vec<u64> = differences.iter().map(|&d| d & mask(W)).collect();
        assert_eq!(decode::<W>(&stream, differences.len()).unwrap(), want, "W={W}");
        stream
    }

    #[test]
    fn tokens_cover_every_width() {
        for width in [1usize, 2, 4, 8] {
            let largest = token_of(mask(width)).0;
            assert_eq!(usize::from(largest) + 1, token_count(width), "width {width}");
            // The sign flip takes token 0, and 0 the top code.
            assert_eq!(code_of(1 << (8 * width - 1), width), 0);
            assert_eq!(code_of(0, width), mask(width));
            assert_eq!(code_of(1, width), 2);
            assert_eq!(code_of(mask(width), width), 1);
        }
        for u in (0..5000u64).chain([u64::MAX, u64::MAX - 1, 1 << 63, (1 << 32) - 1]) {
            let (token, bits) = token_of(u);
            let (low_bits, base) = token_parts(token);
            assert_eq!(bits, low_bits);
            assert_eq!(base | (u & ((1u64 << low_bits) - 1)), u, "u={u}");
        }
        for byte in 0..=255u8 {
            if byte != ESCAPE && byte != 0 {
                let (token, low, bits) = BYTE_TOKENS[usize::from(byte)];
                let u = zigzag(u64::from(byte) | if byte >= 0x80 { !0xff } else { 0 }, 8);
                let (want_token, want_bits) = token_of(u);
                assert_eq!((token, u32::from(bits)), (want_token, want_bits));
                assert_eq!(u64::from(low), u & ((1 << want_bits) - 1));
            }
        }
    }

    #[test]
    fn roundtrips_edges_of_every_width() {
        let edges: Vec<u64> = [1i64, -1, 2, -2, 3, -3, 7, 8, -8, -9, 127, -127, 128, -128, 300, 0, 0x8000, -0x8000]
            .iter()
            .map(|&d| d as u64)
            .chain([i64::MIN as u64, i64::MAX as u64, 1 << 31, 0x8000_0000, 0xffff_ffff, 1 << 40])
            .collect();
        roundtrip::<1>(&edges);
        roundtrip::<2>(&edges);
        roundtrip::<4>(&edges);
        roundtrip::<8>(&edges);
        // One token alone costs nothing per value: the table and the two states.
        let stream = roundtrip::<2>(&[1; 1000]);
        assert_eq!(stream, [2, 0, 0, 0x80, 0x20, 0x00, 0x00, 0x80, 0x00, 0x00, 0x00, 0x80, 0x00]);
        // Odd and even counts, read one by one and in batches of 7 (`decode`), start and end in either state.
        for n in 1..9 {
            roundtrip::<2>(&edges[..n]);
        }
    }

    #[test]
    fn reciprocal_encoding_equals_division() {
        let mut next = crate::core::testing::xorshift(0x9e37_79b9_7f4a_7c15);
        for freq in 1..=PROB_SCALE {
            let start = PROB_SCALE - freq;
            let symbol = EncodeSymbol::new(0, freq, start);
            let limit = freq << 19;
            for k in 0..64u32 {
                let random = next();
                // Any state from 1 to below the limit, edges included (the encoder holds them from limit / 256 on).
                let x = match k {
                    0 => 1,
                    1 => limit - 1,
                    _ => 1 + (random % u64::from(limit - 1)) as u32,
                };
                let want = ((x / freq) << PROB_BITS) + x % freq + start;
                assert_eq!(symbol.next_state(x), want, "freq {freq} x {x}");
            }
        }
    }

    #[test]
    fn rejects_bad_tables_and_ends() {
        let stream = roundtrip::<2>(&[1, 1, u64::MAX, 1, 2, 1, 1, 0x8000]);
        // Every truncation fails, and so does a trailing byte.
        for cut in 0..stream.len() {
            assert!(check_rans::<2>(&stream[..cut], 8).is_err(), "cut at {cut}");
        }
        let mut longer = stream.clone();
        longer.push(0);
        assert!(check_rans::<2>(&longer, 8).is_err());
        // One value fewer leaves the state where the encoder did not start.
        assert!(check_rans::<2>(&stream, 7).is_err());
        // Tables: too many entries for the width, a bad sum, a trailing zero, an overlong frequency.
        assert!(RansReader::new(&[32, 0], 1).is_err());
        assert!(RansReader::new(&[0, 0x80, 0x1f, 0, 0, 0x80, 0], 2).is_err());
        assert!(RansReader::new(&[1, 0x80, 0x20, 0, 0, 0, 0x80, 0], 2).is_err());
        assert!(RansReader::new(&[0, 0xff, 0x00, 0, 0, 0x80, 0], 2).is_err());
        assert!(RansReader::new(&[0, 0x80, 0x20, 0, 0, 0x80, 0, 0, 0, 0x80, 0], 2).is_ok());
        // Either initial state outside [2^23, 2^31), or missing.
        assert!(RansReader::new(&[0, 0x80, 0x20, 0xff, 0xff, 0x7f, 0, 0, 0, 0x80, 0], 2).is_err());
        assert!(RansReader::new(&[0, 0x80, 0x20, 0, 0, 0, 0x80, 0, 0, 0x80, 0], 2).is_err());
        assert!(RansReader::new(&[0, 0x80, 0x20, 0, 0, 0x80, 0, 0xff, 0xff, 0x7f, 0], 2).is_err());
        assert!(RansReader::new(&[0, 0x80, 0x20, 0, 0, 0x80, 0, 0, 0, 0, 0x80], 2).is_err());
        assert!(RansReader::new(&[0, 0x80, 0x20, 0, 0, 0x80, 0], 2).is_err());
    }

    #[test]
    fn flipped_bytes_fail_or_decode() {
        let differences: Vec<u64> =
            (0..500u64).map(|i| [1, u64::MAX, 2, 1, 1, 77, 1, 0x8000][(i % 8) as usize]).collect();
        let stream = roundtrip::<2>(&differences);
        for at in 0..stream.len() {
            for bit in 0..8 {
                let mut bad = stream.clone();
                bad[at] ^= 1 << bit;
                let _ = decode::<2>(&bad, differences.len());
            }
        }
    }

    #[test]
    fn near_the_entropy_of_training_steps() {
        // 90% ±1, 4% ±2, 5.5% ±3..±200, 0.5% sign flips, as benches/workload.py.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            state >> 11
        };
        let differences: Vec<u64> = (0..100_000)
            .map(|_| {
                let (u, sign) = (next() % 1000, if next() % 2 == 0 { 1i64 } else { -1 });
                let magnitude = match u {
                    0..900 => 1,
                    900..940 => 2,
                    940..995 => 3 + (next() % 198) as i64,
                    _ => return 0x8000,
                };
                (sign * magnitude) as u64 & 0xffff
            })
            .collect();
        let mut counts = std::collections::HashMap::new();
        for &d in &differences {
            *counts.entry(d).or_insert(0u64) += 1;
        }
        let n = differences.len() as f64;
        let entropy: f64 = counts.values().map(|&c| c as f64 / n * (n / c as f64).log2()).sum();
        let bits = roundtrip::<2>(&differences).len() as f64 * 8.0 / n;
        assert!(bits < entropy + 0.1, "{bits} bits per value, entropy {entropy}");
    }

    proptest! {
        #[test]
        fn roundtrips_any_differences(
            width in prop::sample::select(vec![1usize, 2, 4, 8]),
            small in prop::collection::vec(-4i64..5, 0..300),
            any_values in prop::collection::vec(any::<u64>(), 0..20),
            seed in any::<u64>(),
        ) {
            let mut differences: Vec<u64> = small.iter().map(|&d| d as u64).chain(any_values).collect();
            if differences.is_empty() {
                return Ok(());
            }
            let len = differences.len();
            differences.rotate_left(seed as usize % len);
            crate::core::codec::with_width!(width, W => { roundtrip::<W>(&differences); });
        }
    }

    // Pins `sum != PROB_SCALE` in `RansReader::new`: a table whose
    // frequencies sum to less than 4096 leaves slots that map to token 0 whatever its frequency, so the decoder is no
    // longer the encoder's inverse; such a table must be refused before any value is decoded.
    #[test]
    fn a_table_summing_to_less_than_the_scale_is_refused() {
        let states = [0u8, 0, 0x80, 0, 0, 0, 0x80, 0]; // both states 2^23, the encoder's start
                                                       // Two entries of frequency 127: they sum to 254.
        let short = [&[0x01u8, 0x7f, 0x7f][..], &states].concat();
        let error = RansReader::new(&short, 2).err().expect("a table summing to 254 is refused");
        assert!(error.contains("sum to 254"), "{error}");
        assert!(check_rans::<2>(&short, 0).is_err());
        // One entry of frequency 4096 (0x80 0x20), the same states: a valid stream of no values.
        let whole = [&[0x00u8, 0x80, 0x20][..], &states].concat();
        assert!(RansReader::new(&whole, 2).is_ok());
    }
}

//! Exact arithmetic expressions: a rational number type and a small recursive-descent parser,
//! shared by the `countdown` checker and the `calculator` tool.
//!
//! Grammar (whitespace between tokens is ignored):
//! ```text
//! expr   := term   (('+' | '-') term)*
//! term   := factor (('*' | '/') factor)*
//! factor := ('+' | '-') factor | '(' expr ')' | number
//! number := digits ['.' digits]
//! ```
//! `×`/`x` and `÷` are accepted for `*` and `/` (models write them). Operators associate to the
//! left and `*` `/` bind tighter than `+` `-`; unary signs bind tightest (`-2*3` is `(-2)*3`).
//!
//! Values are exact rationals over `i128`, so `7/2` is 7/2, not 3.5 rounded, and `1/3*3` is 1.
//! Division by zero, arithmetic overflow, a nesting deeper than [`MAX_DEPTH`] or any syntax
//! error is an [`ExprError`], never a panic.

use std::cmp::Ordering;
use std::fmt;

/// The deepest nesting of parentheses and unary signs accepted: the parser recurses once per
/// level, and a reply of ten thousand `(` must not overflow the stack.
pub const MAX_DEPTH: usize = 64;

/// Why an expression could not be parsed or evaluated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExprError(pub String);

impl fmt::Display for ExprError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn err<T>(message: impl Into<String>) -> Result<T, ExprError> {
    Err(ExprError(message.into()))
}

/// An exact rational number in lowest terms with a positive denominator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Rational {
    num: i128,
    den: i128,
}

/// The positive gcd, computed on magnitudes so that `i128::MIN` cannot overflow `abs` or `%`.
/// Callers never pass two zeros or a zero and `i128::MIN`, so the result fits in `i128`.
fn gcd(a: i128, b: i128) -> i128 {
    let (mut a, mut b) = (a.unsigned_abs(), b.unsigned_abs());
    while b != 0 {
        (a, b) = (b, a % b);
    }
    i128::try_from(a).unwrap_or(i128::MAX)
}

const OVERFLOW: &str = "arithmetic overflow";

impl Rational {
    pub const ZERO: Rational = Rational { num: 0, den: 1 };

    /// `num / den` in lowest terms; a zero denominator (or an overflow) is an error.
    pub fn new(num: i128, den: i128) -> Result<Rational, ExprError> {
        if den == 0 {
            return err("division by zero");
        }
        let g = gcd(num, den);
        let (mut num, mut den) = (num / g, den / g);
        if den < 0 {
            num = num.checked_neg().ok_or_else(|| ExprError(OVERFLOW.into()))?;
            den = den.checked_neg().ok_or_else(|| ExprError(OVERFLOW.into()))?;
        }
        Ok(Rational { num, den })
    }

    pub fn integer(n: i128) -> Rational {
        Rational { num: n, den: 1 }
    }

    pub fn numer(&self) -> i128 {
        self.num
    }

    pub fn denom(&self) -> i128 {
        self.den
    }

    /// The value as an integer, when it is one.
    pub fn to_integer(&self) -> Option<i128> {
        (self.den == 1).then_some(self.num)
    }

    /// Parses unsigned `digits[.digits]` exactly (`0.25` is 1/4). Nothing else is accepted.
    pub fn parse_decimal(text: &str) -> Result<Rational, ExprError> {
        let (int, frac) = text.split_once('.').unwrap_or((text, ""));
        let all_digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
        if int.is_empty() || !all_digits(int) || !all_digits(frac) || (text.contains('.') && frac.is_empty()) {
            return err(format!("not a number: `{text}`"));
        }
        let digits: String = format!("{int}{frac}");
        let num: i128 = digits.parse().map_err(|_| ExprError(format!("number too large: `{text}`")))?;
        let den = u32::try_from(frac.len())
            .ok()
            .and_then(|k| 10i128.checked_pow(k))
            .ok_or_else(|| ExprError(format!("number too long: `{text}`")))?;
        Rational::new(num, den)
    }

    pub fn checked_add(self, o: Rational) -> Result<Rational, ExprError> {
        let ov = || ExprError(OVERFLOW.into());
        let num = self
            .num
            .checked_mul(o.den)
            .and_then(|a| o.num.checked_mul(self.den).and_then(|b| a.checked_add(b)))
            .ok_or_else(ov)?;
        Rational::new(num, self.den.checked_mul(o.den).ok_or_else(ov)?)
    }

    pub fn checked_neg(self) -> Result<Rational, ExprError> {
        Ok(Rational { num: self.num.checked_neg().ok_or_else(|| ExprError(OVERFLOW.into()))?, den: self.den })
    }

    pub fn checked_sub(self, o: Rational) -> Result<Rational, ExprError> {
        self.checked_add(o.checked_neg()?)
    }

    pub fn checked_mul(self, o: Rational) -> Result<Rational, ExprError> {
        let ov = || ExprError(OVERFLOW.into());
        // Cross-reduce first so that products of reduced fractions overflow as late as possible.
        let g1 = gcd(self.num, o.den).max(1);
        let g2 = gcd(o.num, self.den).max(1);
        let num = (self.num / g1).checked_mul(o.num / g2).ok_or_else(ov)?;
        let den = (self.den / g2).checked_mul(o.den / g1).ok_or_else(ov)?;
        Rational::new(num, den)
    }

    pub fn checked_div(self, o: Rational) -> Result<Rational, ExprError> {
        if o.num == 0 {
            return err("division by zero");
        }
        self.checked_mul(Rational::new(o.den, o.num)?)
    }
}

impl Ord for Rational {
    fn cmp(&self, o: &Self) -> Ordering {
        // Denominators are positive, so cross-multiplication keeps the order; i128 products of
        // the values seen here do not overflow in practice, and saturating keeps it total.
        self.num.saturating_mul(o.den).cmp(&o.num.saturating_mul(self.den))
    }
}

impl PartialOrd for Rational {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}

/// `7`, `-7` or `7/2`.
impl fmt::Display for Rational {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.den == 1 {
            write!(f, "{}", self.num)
        } else {
            write!(f, "{}/{}", self.num, self.den)
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinOp {
    Add,
    Sub,
    Mul,
    Div,
}

/// A parsed expression.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Expr {
    Num(Rational),
    Neg(Box<Expr>),
    Bin(BinOp, Box<Expr>, Box<Expr>),
}

impl Expr {
    /// The exact value; division by zero or overflow is an error.
    pub fn eval(&self) -> Result<Rational, ExprError> {
        match self {
            Expr::Num(x) => Ok(*x),
            Expr::Neg(e) => e.eval()?.checked_neg(),
            Expr::Bin(op, a, b) => {
                let (a, b) = (a.eval()?, b.eval()?);
                match op {
                    BinOp::Add => a.checked_add(b),
                    BinOp::Sub => a.checked_sub(b),
                    BinOp::Mul => a.checked_mul(b),
                    BinOp::Div => a.checked_div(b),
                }
            }
        }
    }

    /// The number literals, left to right (countdown checks which given numbers were used).
    pub fn numbers(&self) -> Vec<Rational> {
        let mut out = Vec::new();
        self.collect_numbers(&mut out);
        out
    }

    fn collect_numbers(&self, out: &mut Vec<Rational>) {
        match self {
            Expr::Num(x) => out.push(*x),
            Expr::Neg(e) => e.collect_numbers(out),
            Expr::Bin(_, a, b) => {
                a.collect_numbers(out);
                b.collect_numbers(out);
            }
        }
    }
}

/// Parses a whole expression; trailing text is an error.
pub fn parse(text: &str) -> Result<Expr, ExprError> {
    let mut p = Parser { chars: text.chars().collect(), pos: 0, depth: 0 };
    let e = p.expr()?;
    p.skip_ws();
    if p.pos < p.chars.len() {
        return err(format!("unexpected `{}` at position {}", p.chars[p.pos], p.pos));
    }
    Ok(e)
}

/// Parses and evaluates.
pub fn evaluate(text: &str) -> Result<Rational, ExprError> {
    parse(text)?.eval()
}

struct Parser {
    chars: Vec<char>,
    pos: usize,
    depth: usize,
}

impl Parser {
    fn skip_ws(&mut self) {
        while self.pos < self.chars.len() && self.chars[self.pos].is_whitespace() {
            self.pos += 1;
        }
    }

    fn peek(&mut self) -> Option<char> {
        self.skip_ws();
        self.chars.get(self.pos).copied()
    }

    fn enter(&mut self) -> Result<(), ExprError> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return err(format!("expression nested deeper than {MAX_DEPTH} levels"));
        }
        Ok(())
    }

    fn expr(&mut self) -> Result<Expr, ExprError> {
        let mut left = self.term()?;
        loop {
            let op = match self.peek() {
                Some('+') => BinOp::Add,
                Some('-' | '−') => BinOp::Sub,
                _ => return Ok(left),
            };
            self.pos += 1;
            let right = self.term()?;
            left = Expr::Bin(op, Box::new(left), Box::new(right));
        }
    }

    fn term(&mut self) -> Result<Expr, ExprError> {
        let mut left = self.factor()?;
        loop {
            let op = match self.peek() {
                Some('*' | '×' | 'x') => BinOp::Mul,
                Some('/' | '÷') => BinOp::Div,
                _ => return Ok(left),
            };
            self.pos += 1;
            let right = self.factor()?;
            left = Expr::Bin(op, Box::new(left), Box::new(right));
        }
    }

    fn factor(&mut self) -> Result<Expr, ExprError> {
        self.enter()?;
        let result = match self.peek() {
            Some('+') => {
                self.pos += 1;
                self.factor()
            }
            Some('-' | '−') => {
                self.pos += 1;
                self.factor().map(|e| Expr::Neg(Box::new(e)))
            }
            Some('(') => {
                self.pos += 1;
                let e = self.expr()?;
                match self.peek() {
                    Some(')') => {
                        self.pos += 1;
                        Ok(e)
                    }
                    Some(c) => err(format!("expected `)` at position {}, found `{c}`", self.pos)),
                    None => err("missing `)`"),
                }
            }
            Some(c) if c.is_ascii_digit() => self.number(),
            Some(c) => err(format!("unexpected `{c}` at position {}", self.pos)),
            None => err("unexpected end of expression"),
        };
        self.depth -= 1;
        result
    }

    fn number(&mut self) -> Result<Expr, ExprError> {
        let start = self.pos;
        while self.pos < self.chars.len() && (self.chars[self.pos].is_ascii_digit() || self.chars[self.pos] == '.') {
            self.pos += 1;
        }
        let text: String = self.chars[start..self.pos].iter().collect();
        Ok(Expr::Num(Rational::parse_decimal(&text)?))
    }
}

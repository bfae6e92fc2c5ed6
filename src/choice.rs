//! Closed choices: fieldless enums written (in run configs, on the wire) as one of their names,
//! declared once where they belong (an algorithm's in `algo`, a pause mode in `rollout`) and held
//! as they are by the configs that choose them.
//!
//! [`choice!`](crate::choice!) declares such an enum with its names and the kind of thing it names, and gives
//! it `Serialize`/`Deserialize` as those names. An unknown name is a deserialisation error that
//! names the kind, suggests the nearest valid name and lists them all (`unknown mode `asyncc`;
//! did you mean `async`? (valid: sync, async)`); the config resolver prefixes the dotted key and
//! where the value came from. Parsing happens once, when the config is loaded.

/// `choice! { /// docs
///     pub enum Mode("mode") { /// docs
///         Sync = "sync", Async = "async" } }`
#[macro_export]
macro_rules! choice {
    ($(#[$meta:meta])* $vis:vis enum $name:ident($kind:literal) {
        $($(#[$vmeta:meta])* $variant:ident = $text:literal),+ $(,)?
    }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        $vis enum $name { $($(#[$vmeta])* $variant),+ }

        impl $name {
            /// Every valid name, in declaration order.
            pub const NAMES: &'static [&'static str] = &[$($text),+];
            /// What a name of this choice names, for messages.
            pub const KIND: &'static str = $kind;

            /// The name written in configs.
            pub fn name(self) -> &'static str {
                match self { $($name::$variant => $text),+ }
            }

            /// The choice called `name`, or an error naming the valid ones.
            pub fn from_name(name: &str) -> ::std::result::Result<Self, String> {
                match name {
                    $($text => Ok($name::$variant),)+
                    _ => Err($crate::error::unknown_name_message(Self::KIND, name, Self::NAMES)),
                }
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                self.name() == *other
            }
        }

        impl ::std::fmt::Display for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.name())
            }
        }

        impl ::serde::Serialize for $name {
            fn serialize<S: ::serde::Serializer>(&self, s: S) -> ::std::result::Result<S::Ok, S::Error> {
                s.serialize_str(self.name())
            }
        }

        impl<'de> ::serde::Deserialize<'de> for $name {
            fn deserialize<D: ::serde::Deserializer<'de>>(d: D) -> ::std::result::Result<Self, D::Error> {
                let name = <::std::string::String as ::serde::Deserialize>::deserialize(d)?;
                $name::from_name(&name).map_err(<D::Error as ::serde::de::Error>::custom)
            }
        }
    };
}

#[cfg(test)]
mod tests {
    crate::choice! {
        /// A test choice.
        enum Colour("colour") { Red = "red", DarkBlue = "dark_blue" }
    }

    #[test]
    fn names_round_trip_and_unknown_names_are_explained() {
        for c in [Colour::Red, Colour::DarkBlue] {
            assert_eq!(Colour::from_name(c.name()), Ok(c));
            let json = serde_json::to_string(&c).unwrap();
            assert_eq!(json, format!("\"{}\"", c.name()));
            assert_eq!(serde_json::from_str::<Colour>(&json).unwrap(), c);
        }
        assert_eq!(
            Colour::from_name("dark_blu").unwrap_err(),
            "unknown colour `dark_blu`; did you mean `dark_blue`? (valid: red, dark_blue)"
        );
        let err = serde_json::from_str::<Colour>("\"green\"").unwrap_err().to_string();
        assert!(err.starts_with("unknown colour `green`"), "{err}");
    }
}
